package server

import (
	"net/http"

	"github.com/spacedev/space/internal/rest"
)

// registerNodes registers the node verbs (operators only; GET /v1/nodes lists).
func (a *API) registerNodes(authed func(string, rest.HandlerFunc)) {
	authed("POST /v1/nodes/{name}/cordon", a.cordonNode(true))
	authed("POST /v1/nodes/{name}/uncordon", a.cordonNode(false))
	authed("DELETE /v1/nodes/{name}", a.removeNode)
	authed("POST /v1/nodes/{name}/drain", a.drainNode)
}

func (a *API) cordonNode(on bool) rest.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		n, err := a.svc.Cordon(r.Context(), principalFrom(r.Context()), r.PathValue("name"), on)
		if err != nil {
			return err
		}
		rest.WriteJSON(w, http.StatusOK, n)
		return nil
	}
}

func (a *API) removeNode(w http.ResponseWriter, r *http.Request) error {
	rm, err := a.svc.RemoveNode(r.Context(), principalFrom(r.Context()), r.PathValue("name"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, rm)
	return nil
}

// drainNode cordons a node and moves its running sandboxes elsewhere: 202 with the
// node_drain operation (GET /v1/operations/{id}/wait waits for it).
func (a *API) drainNode(w http.ResponseWriter, r *http.Request) error {
	op, err := a.svc.Drain(r.Context(), principalFrom(r.Context()), r.PathValue("name"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusAccepted, op.API())
	return nil
}
