"""Builtin recipes (YAML) and their schema, shipped as package data."""
