"""Built-in recipe presets (YAML), installed as package data of specbatch.recipes."""
