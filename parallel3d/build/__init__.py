"""How ``initialize`` turns a model into this rank's share: the parallel steps in their order (`apply`),
the meta-device start (`meta_init`, `storageless`), PEFT models (`peft_model`, `peft_meta`), model
directories' own code (`remote_code`), regional compilation (`compiled_blocks`) and the start-up checks
and notices (`optimizer_check`, `stage3_notice`)."""
