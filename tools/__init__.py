"""Command-line tools (run as scripts: python tools/<name>.py --help)."""
