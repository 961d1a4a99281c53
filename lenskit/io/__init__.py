"""What comes in from files: checkpoints (`loading`), tokenizers (`tokenizer`), text to tokens (`text`) and
token data for training and evaluation (`data`)."""
