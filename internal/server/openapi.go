package server

import (
	"net/http"

	"github.com/spacedev/space/api"
)

func serveOpenAPI(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(api.OpenAPI)
}
