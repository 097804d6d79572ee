"""TargetModel and DraftModel: a model engine behind a streaming `generate`."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from configs.schemas import ModelStageConfig
from engines.service import ModelService
from engines.types import GenerateChunk, GenerateRequest


class _ModelDeployment:
    def __init__(self, args: dict) -> None:
        config = ModelStageConfig.model_validate(args)
        self.service = ModelService(config.engine)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        async for chunk in self.service.generate(request):
            yield chunk

    async def stats(self) -> dict[str, int]:
        return self.service.stats.as_dict()


@serve.deployment(name="TargetModel")
class TargetModel(_ModelDeployment):
    pass


@serve.deployment(name="DraftModel")
class DraftModel(_ModelDeployment):
    pass
