package api

import (
	_ "embed"
	"fmt"

	"sigs.k8s.io/yaml"
)

// openapiYAML is the OpenAPI 3.1 document describing the HTTP API, as written in
// api/openapi.yaml (the source of truth).
//
//go:embed openapi.yaml
var openapiYAML []byte

// OpenAPI is the OpenAPI document converted to JSON once at package initialization;
// the server serves it at /v1/openapi.json. openapi_test.go checks that the document is
// well-formed (so the conversion cannot panic in a released build) and that every
// route the server registers is documented.
var OpenAPI = mustJSON(openapiYAML)

func mustJSON(doc []byte) []byte {
	b, err := yaml.YAMLToJSON(doc)
	if err != nil {
		panic(fmt.Sprintf("api: openapi.yaml is not valid YAML: %v", err))
	}
	return b
}
