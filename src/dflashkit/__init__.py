"""dflashkit: train, evaluate and serve DFlash block-diffusion drafters (docs/architecture.md)."""


def versions() -> str:
    """dflashkit's version and the torch and transformers it runs on, for logs and reports."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    return f"dflashkit {of('dflashkit')} (torch {of('torch')}, transformers {of('transformers')})"
