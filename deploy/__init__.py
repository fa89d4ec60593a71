"""The serving shell: the OpenAI API (openai_api), the Ray Serve app (app), the CLI (cli)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dflash-serve")
except PackageNotFoundError:  # run from a checkout without `pip install -e .`
    __version__ = "0+unknown"
