class ScoreError(Exception):
    """An error to report to the client, with its HTTP status."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed",
             408: "RequestTimeout", 409: "Conflict", 413: "RequestEntityTooLarge",
             500: "InternalServerError", 501: "NotImplementedError",
             503: "ServiceUnavailable"}

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status

    @property
    def type(self) -> str:
        return self.TYPES.get(self.status, "Error")
