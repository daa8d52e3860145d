"""What the service answers a request it will not run: `Refused` carries one line naming the cause and what to do,
which the client raises as its own error (RequestFailedError for a request's future, an HTTP status error for a
direct call). A call that fails for another reason is the server's fault and is answered as such."""


class Refused(ValueError):
    """A request the service will not run, with one line saying why and what to do instead."""


class NotServed(Refused):
    """An operation of the Tinker API this service does not serve, named."""

    def __init__(self, operation: str, instead: str = ""):
        super().__init__(f"{operation} is not served by forge_rl's Tinker service{'; ' + instead if instead else ''}")
