"""The one exception the data pipeline raises for problems a user can cause and fix."""


class DataError(ValueError):
    """Bad data input (missing/corrupt file, wrong tokenizer, bad split), explained in one sentence.

    A ValueError subclass so callers that already catch ValueError for bad configuration keep
    working; the message always names the offending file or argument and says how to fix it.
    """
