"""finetune: config-driven fine-tuning of language models. Version only: no heavy imports here."""

__version__ = "0.1.0"
