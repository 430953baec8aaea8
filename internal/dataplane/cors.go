package dataplane

import (
	"net/http"
	"strings"
)

// CORS lets web pages of any origin (the web console, served by an api
// process that is usually another origin than the node's data plane) call the data
// plane's token-authorized endpoints: attach, stdin, signal and resize.
//
// Allowing every origin is safe here because the data plane has no ambient
// credentials: no cookies, no HTTP authentication, nothing a browser attaches on its
// own. A request is authorized only by an attachment token the page must already hold
// and send explicitly, and a holder of a token can use it from anywhere anyway. CORS
// protects ambient credentials; there are none to protect. The internal agent proxy
// (/internal/…) gets no CORS headers.
func CORS(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.URL.Path, "/v1/dp/") {
			h.ServeHTTP(w, r)
			return
		}
		hd := w.Header()
		hd.Set("Access-Control-Allow-Origin", "*")
		if r.Method == http.MethodOptions && r.Header.Get("Access-Control-Request-Method") != "" {
			hd.Set("Access-Control-Allow-Methods", "GET, POST")
			hd.Set("Access-Control-Allow-Headers", "Authorization, Content-Type, Last-Event-ID")
			hd.Set("Access-Control-Max-Age", "600")
			w.WriteHeader(http.StatusNoContent)
			return
		}
		h.ServeHTTP(w, r)
	})
}
