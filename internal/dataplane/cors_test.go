package dataplane_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/spacedev/space/internal/dataplane"
)

// TestDataPlaneCORS checks the preflight and the headers on data-plane answers, and
// that nothing else gets them.
func TestDataPlaneCORS(t *testing.T) {
	inner := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusTeapot) })
	h := dataplane.CORS(inner)
	req := httptest.NewRequest("OPTIONS", "/v1/dp/sandboxes/x/processes/1/stdin", nil)
	req.Header.Set("Origin", "http://console.example")
	req.Header.Set("Access-Control-Request-Method", "POST")
	req.Header.Set("Access-Control-Request-Headers", "authorization,content-type")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	if w.Code != 204 || w.Header().Get("Access-Control-Allow-Origin") != "*" ||
		!strings.Contains(w.Header().Get("Access-Control-Allow-Headers"), "Authorization") {
		t.Errorf("preflight: %d %v", w.Code, w.Header())
	}
	if w.Header().Get("Access-Control-Allow-Credentials") != "" {
		t.Error("credentials must never be allowed")
	}
	w = httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "/v1/dp/sandboxes/x/processes/1/attach", nil))
	if w.Code != http.StatusTeapot || w.Header().Get("Access-Control-Allow-Origin") != "*" {
		t.Errorf("attach: %d %v", w.Code, w.Header())
	}
	w = httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "/internal/v1/sandboxes/x/agent/v1/files", nil))
	if w.Header().Get("Access-Control-Allow-Origin") != "" {
		t.Error("the internal agent proxy got CORS headers")
	}
}
