"""The ``dptrain`` subcommands (one module each) and what they share."""


def check_new_file(option: str, path, force: bool) -> None:
    """An output file a command is about to write: never a directory, and never an existing
    file unless ``force`` (nothing written before is lost). ConfigError naming ``option``."""
    from pathlib import Path

    from dptrain.config import ConfigError

    path = Path(path)
    if path.is_dir():
        raise ConfigError(option, f"{path} is a directory")
    if path.exists() and not force:
        raise ConfigError(option, f"{path} exists; pass --force to overwrite it")
