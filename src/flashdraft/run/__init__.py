"""What a run leaves beside its checkpoints: the environment fingerprint and the S3 mirror.

Submodules are imported by name (`flashdraft.run.fingerprint`, `flashdraft.run.s3`) so that neither
torch nor boto3 is loaded until it is used.
"""
