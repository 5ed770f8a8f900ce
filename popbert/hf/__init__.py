"""Hugging Face checkpoints both ways: names and config fields per family (`mapping`,
`modernbert`), whole folders read and written (`checkpoint`)."""
