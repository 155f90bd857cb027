"""The version of this dlwatch (a leaf: importing it loads nothing else)."""

__version__ = "0.1.0"
