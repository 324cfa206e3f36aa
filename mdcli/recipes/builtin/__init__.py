"""The built-in recipes: YAML files shipped inside the package, read with importlib.resources."""
