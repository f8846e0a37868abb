# Every status the server answers with: (HTTP reason phrase, error type in the JSON body).
STATUSES = {
    200: ("OK", None),
    400: ("Bad Request", "BadRequestError"),
    401: ("Unauthorized", "AuthenticationError"),
    403: ("Forbidden", "PermissionDeniedError"),
    404: ("Not Found", "NotFoundError"),
    405: ("Method Not Allowed", "MethodNotAllowed"),
    408: ("Request Timeout", "RequestTimeout"),
    409: ("Conflict", "Conflict"),
    413: ("Payload Too Large", "RequestEntityTooLarge"),
    417: ("Expectation Failed", "ExpectationFailed"),
    431: ("Request Header Fields Too Large", "RequestHeaderFieldsTooLarge"),
    500: ("Internal Server Error", "InternalServerError"),
    501: ("Not Implemented", "NotImplementedError"),
    503: ("Service Unavailable", "ServiceUnavailable"),
}


class ScoreError(Exception):
    """An error to report to the client, with its HTTP status (one of STATUSES)."""

    def __init__(self, message: str, status: int = 400):
        if status not in STATUSES or STATUSES[status][1] is None:
            raise ValueError(f"{status} is not an error status of STATUSES")
        super().__init__(message)
        self.message = message
        self.status = status

    @property
    def type(self) -> str:
        return STATUSES[self.status][1]
