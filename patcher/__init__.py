"""dsadapt: carry DeepSeek adaptation patch stacks on top of inference engines."""

__version__ = "0.1.0"
