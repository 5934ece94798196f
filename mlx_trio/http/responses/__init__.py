"""The OpenAI Responses API (`/v1/responses`): requests, response objects, stream events, stored responses."""
