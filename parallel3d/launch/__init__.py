"""``zero3d launch`` (`launcher`) and the torchrun agent it starts on every node (`agent`)."""
