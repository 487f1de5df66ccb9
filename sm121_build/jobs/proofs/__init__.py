"""What `prove` does: its cases, its children's lines read as outside input, the proof
document and reading a proof back (`prove --files`, `prove IMAGE`)."""
