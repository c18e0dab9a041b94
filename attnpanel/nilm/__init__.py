"""The demo: a NILMFormer trained on synthetic household power, an example that uses the
library (the library never imports it)."""
