"""Shim: `python cli.py ...` is `quantkit ...`."""

from quantkit.cli import main

if __name__ == "__main__":
    main()
