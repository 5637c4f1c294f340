"""impasto: train and fine-tune Stable Diffusion XL and diffusion transformers with PyTorch."""

__version__ = "0.1.0"


def train(config, resume: bool = True):
    """Train the run described by ``config`` (a :class:`impasto.config.Config`)."""
    from impasto.train import train as _train

    return _train(config, resume=resume)


__all__ = ["__version__", "train"]
