"""The guest agent: the one program inside every sandbox of every engine."""
