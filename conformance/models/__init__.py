"""Real models: the zoo of tiny Hugging Face models, the toy target, and the repro script of a real model's case."""
