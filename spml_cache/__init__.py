"""spml-cache: single-positive multi-label learning over a cached ResNet-50 feature matrix."""

__version__ = "0.1.0"
