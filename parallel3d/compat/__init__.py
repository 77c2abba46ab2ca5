"""DeepSpeed's surface on Zero3D: ``DeepSpeedEngine``'s methods (`deepspeed_surface`),
``deepspeed.initialize``'s arguments (`ds_arguments`), ``GatheredParameters`` (`gathered`) and the
``safe_get_full_*`` accessors (`param_access`)."""
