from ..bert_padding import _unavailable as all_gather  # noqa: F401
