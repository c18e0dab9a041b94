"""The sentence the MiniLM tests and ``apps/text.py`` use by default, and its tokens."""

SENTENCE = "The cat sat on the mat because it was warm."
TOKENS = [
    "[CLS]",
    "the",
    "cat",
    "sat",
    "on",
    "the",
    "mat",
    "because",
    "it",
    "was",
    "warm",
    ".",
    "[SEP]",
]
