"""Text and the model's files: the tokenizer and what every service agrees on about it (tokenization), the chat
template (chat_template), grammars for constrained output (grammar), and finding the model (model_files)."""
