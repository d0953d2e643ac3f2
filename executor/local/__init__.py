"""This machine's workarounds: persistent local clusters on loopback, keeping cores awake."""
