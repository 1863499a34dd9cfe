"""Training the shipped tiny model (`mimo-epd train-tiny`): the corpus, the tokenizer, the samples, the loop and
the export to a checkpoint directory. Nothing here runs when serving."""
