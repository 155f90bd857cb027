"""The transparency harness: a watched program does exactly what the bare one does (see test_transparency)."""
