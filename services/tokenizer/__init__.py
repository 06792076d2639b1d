"""The tokenizer service: request_received -> chat template, token ids, length check -> preprocessed."""
