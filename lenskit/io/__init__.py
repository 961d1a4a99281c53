"""What comes in from files: checkpoints (`loading`), tokenizers (`tokenizer`), text to tokens (`text`) and
token data for training and evaluation (`data`); reading a user's files safely (`files`: regular files only,
bounded JSON), the hub cache (`hubcache`), memory-mapped weights (`mapped`) and foreign `.pt` files (`torchfile`)."""
