"""The Zero3D config: DeepSpeed's JSON schema typed and validated (`config`), one pydantic model per
DeepSpeed block (`sections`)."""
