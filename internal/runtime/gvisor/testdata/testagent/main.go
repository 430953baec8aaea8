// Command testagent is a stand-in for space-agent used by the gVisor runtime tests. It
// listens on $SPACE_AGENT_LISTEN (unix:PATH) and answers a few inspection endpoints so
// tests can look inside the sandbox. It depends on the standard library only.
package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "testagent:", err)
		os.Exit(1)
	}
}

func run() error {
	listen := os.Getenv("SPACE_AGENT_LISTEN")
	path, ok := strings.CutPrefix(listen, "unix:")
	if !ok {
		return fmt.Errorf("SPACE_AGENT_LISTEN=%q: want unix:PATH", listen)
	}
	_ = os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/health", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, map[string]string{"version": "test"})
	})
	mux.HandleFunc("GET /meminfo", func(w http.ResponseWriter, r *http.Request) {
		b, err := os.ReadFile("/proc/meminfo")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Write(b)
	})
	mux.HandleFunc("GET /netdevs", func(w http.ResponseWriter, r *http.Request) {
		ifs, err := net.Interfaces()
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		names := []string{}
		for _, i := range ifs {
			names = append(names, i.Name)
		}
		writeJSON(w, names)
	})
	mux.HandleFunc("GET /env", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, os.Environ())
	})
	mux.HandleFunc("GET /mounts", func(w http.ResponseWriter, r *http.Request) {
		b, err := os.ReadFile("/proc/self/mounts")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Write(b)
	})
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, r *http.Request) {
		b, err := os.ReadFile("/proc/self/status")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Write(b)
	})
	// POST /write?path=P writes the request body to P (inside the sandbox).
	mux.HandleFunc("POST /write", func(w http.ResponseWriter, r *http.Request) {
		f, err := os.Create(r.URL.Query().Get("path"))
		if err == nil {
			_, err = f.ReadFrom(r.Body)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	return http.Serve(l, mux)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}
