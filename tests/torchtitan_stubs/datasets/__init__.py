"""A stand-in for Hugging Face's `datasets`, which torchtitan's config registry imports (for its
data loaders) and the torchtitan tests never call: only tests/torchtitan_worker.py puts it on
sys.path."""


class Dataset:
    """Named in torchtitan's type hints only."""


def load_dataset(*args: object, **kwargs: object) -> Dataset:
    raise RuntimeError("the torchtitan tests load no data set")
