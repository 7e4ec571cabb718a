"""What a step's tokens become: detokenized text, stream chunks, lifecycle events, result dicts."""
