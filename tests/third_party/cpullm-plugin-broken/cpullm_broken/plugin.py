"""Fails on import, as a plugin with a missing native dependency would."""
raise ImportError("cpullm-plugin-broken needs libfrobnicate, which is not installed")
