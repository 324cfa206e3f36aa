"""Built-in recipes, installed as the package `mdcli.recipes_builtin` (see pyproject.toml).

This file makes the folder a regular package, so `importlib.resources.files(...)` finds the YAML
files both in an editable install and in a wheel.
"""
