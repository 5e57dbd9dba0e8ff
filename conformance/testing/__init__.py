"""Test fixtures shipped with the suite: deliberately broken parts the lanes must catch."""
