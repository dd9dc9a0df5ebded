"""spml-cache: single-positive multi-label learning over a cached feature matrix of a frozen backbone (any: ResNet-50,
the papers', by default)."""

__version__ = "0.1.0"
