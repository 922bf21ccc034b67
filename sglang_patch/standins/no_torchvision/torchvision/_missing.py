"""Placeholders: attribute access works (class bodies use e.g. InterpolationMode.BICUBIC as a
default), calling anything raises a clear error."""


class Missing:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name}: eaglenest's torchvision stand-in has no vision ops; install a "
            f"torchvision that matches your torch to serve vision models"
        )

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


def module_getattr(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{module}.{name}")

    return __getattr__
