"""The library's version (the package's ``__version__``; pyproject's ``version`` agrees, a
unit test checks). Its own module so that any layer can name it without importing the
package's top level."""

__all__ = ["__version__"]

__version__ = "0.2.0"
