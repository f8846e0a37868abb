"""The text int8 smoothing measures activations on (model.smoothing): written for this project,
in the shapes scoring and reranking see: queries, product listings, passages, questions,
a little code and numbers, and the prompts' own wording."""

CALIBRATION_TEXT = """\
Query: I am looking for a waterproof jacket for walking the dog in autumn.
Item: Lightweight shell jacket, taped seams, packs into its own pocket, sizes XS to XXL.
Is this a good match? Answer yes or no: yes
Query: a gift for a ten-year-old who likes space.
Item: Glow-in-the-dark star map poster, 60 x 90 cm, printed on recycled paper.
Item: Stainless steel garlic press with a silicone cleaning brush.
Item: Build-your-own model of the solar system, motorised, batteries not included.

The library on Elm Street opens at nine on weekdays and at ten on Saturdays. It lends books,
films and board games, and its reading room has forty seats by the windows. Members can
reserve a study room for up to three hours a day; the booking form asks for a name, a card
number and the number of people.

Q: Why does bread dough need to rest before baking?
A: Resting lets the gluten relax and the yeast produce gas, so the loaf rises evenly and the
crumb is light rather than dense. A first rise of one to two hours at room temperature is
typical; a slow rise in the fridge overnight gives more flavour.

def mean(values):
    total = 0.0
    for v in values:
        total += v
    return total / len(values) if values else float("nan")

Order #48213 shipped on 14 March 2025: 2 x USB-C cable (1 m) at 7.99 EUR, 1 x laptop stand at
34.50 EUR, shipping 4.90 EUR, total 55.38 EUR including VAT. Estimated delivery: 3-5 days.

<|im_start|>system
Judge whether the Document meets the requirements based on the Query and the Instruct
provided. Note that the answer can only be "yes" or "no".<|im_end|>
<|im_start|>user
<Instruct>: Given a web search query, retrieve relevant passages that answer the query
<Query>: how long do tomato seeds take to germinate
<Document>: Tomato seeds usually sprout in five to ten days when the soil stays between 21 and
27 degrees Celsius. Cooler soil slows germination to two weeks or more.<|im_end|>
<|im_start|>assistant

The river rises in the hills to the north, runs south through farmland and two small towns,
and reaches the sea after 212 kilometres. In spring the melting snow can double its flow, and
the lower valley floods about one year in ten. A dam built in 1968 supplies water to 300,000
people and generates electricity for the region.

Rating: 4 out of 5. Comfortable headphones with good noise cancelling on trains and planes.
The battery lasts about thirty hours, but the case is bulky and the app asks for too many
permissions. Would buy again at this price.

SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id)
WHERE orders.created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 10;

To reset the router, hold the button on the back for ten seconds until the light blinks
orange, wait two minutes, then connect to the network printed on the label. The default
password is on the same label; change it on first login under Settings > Security.

Query: best budget phone with a long battery life
Document: The phone's 5,000 mAh battery lasted a day and a half in our tests with the screen
at medium brightness, and it charges from empty to full in about ninety minutes.
Document: This tablet case folds into a stand and comes in six colours.

Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It takes place in
the chloroplasts, where chlorophyll absorbs mostly red and blue light, which is why leaves
look green. Most of the oxygen in the air was made this way.

Meeting notes, Tuesday: the release moves to the 18th; Ana owns the migration script; the
load test found p99 latency of 420 ms at 1,200 requests per second, above the 300 ms target.
Next steps: profile the tokenizer, cache the templates, and rerun on Friday.

Il pleut depuis ce matin, mais le marché est ouvert jusqu'à midi. Der Zug nach Berlin fährt
um 14:32 von Gleis 7 ab. El museo está cerrado los lunes.

Item: Cast iron skillet, 26 cm, pre-seasoned, oven safe to 260 C. Answer yes or no: no
Item: Beginner's guide to sourdough, 180 pages, with a week-by-week starter schedule.
Item: Ergonomic office chair with lumbar support and adjustable armrests.
"""
