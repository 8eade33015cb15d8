"""The model: loading it (loading.py; files.py checks a model directory's files first; tokenizer.py for the
tokenizer, vocab.py for added tokens), what finetune
knows per architecture (architectures.py), the model with its fused loss in one forward (with_loss.py), the
start-of-run proof that packed documents stay apart (isolation.py), and opt-in speed-ups of its layers (kernels.py:
Liger, compile)."""
