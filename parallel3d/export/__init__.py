"""``zero3d export``: a checkpoint -> a Hugging Face directory (`export`), PEFT adapters (`adapter`), what it
may overwrite (`guard`), the special token ids (`tokens`) and what it wrote (`report`)."""
