"""Conveyor's processes: gateway, tokenizer, scheduler, worker, and the `conveyor` command line."""
