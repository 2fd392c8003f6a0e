{{/*
The chart name, or nameOverride.
*/}}
{{- define "xpyd-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name of the release's objects: fullnameOverride, else <release>-<name> (just the release
name when it already contains the name). 63 characters at most: some fields are DNS labels.
*/}}
{{- define "xpyd-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "xpyd-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every object of the release.
*/}}
{{- define "xpyd-operator.labels" -}}
helm.sh/chart: {{ include "xpyd-operator.chart" . }}
{{ include "xpyd-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: xpyd
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels the operator Deployment selects its pod by: stable for the life of the release.
*/}}
{{- define "xpyd-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "xpyd-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The operator's ServiceAccount.
*/}}
{{- define "xpyd-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "xpyd-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image; the operator runs its proxy pods from the same image.
*/}}
{{- define "xpyd-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
What the operator does, as RBAC rules (the same in a ClusterRole and in per-namespace Roles).
No delete: children are garbage-collected through their ownerReferences. The DisaggregatedServings
and everything the operator creates are listed and watched: its reads come from watch-fed caches.
Only the status of a DisaggregatedServing is written. Pods are read for the status and the
autoscaler, and because the operator grants its proxies pods get/list/watch and pods/status patch
(their KV-transfer health and held-requests conditions on their own pods: the latter is the demand
signal of a pool at zero, which the operator reads from its pod watch) in a Role, which RBAC allows only to a
holder of the same permissions. The operator itself never patches a pod's status. Secrets: get only, of the ones an autoscaled
object names for its Prometheus (bearer token, CA); never listed or watched.
*/}}
{{- define "xpyd-operator.rules" -}}
- apiGroups: ["xpyd.io"]
  resources: ["disaggregatedservings"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["xpyd.io"]
  resources: ["disaggregatedservings/status"]
  verbs: ["get", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end }}

{{/*
The rules on LeaderWorkerSets (multi-node replicas), granted with the others when
xpyd-operator.leaderWorkerSet says so.
*/}}
{{- define "xpyd-operator.leaderWorkerSetRules" -}}
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end }}

{{/*
"true" when the operator gets RBAC on LeaderWorkerSets (multi-node replicas): rbac.leaderWorkerSet
"auto" grants it when the cluster serves leaderworkerset.x-k8s.io/v1 at install time.
*/}}
{{- define "xpyd-operator.leaderWorkerSet" -}}
{{- $mode := toString .Values.rbac.leaderWorkerSet -}}
{{- if or (eq $mode "true") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "leaderworkerset.x-k8s.io/v1")) -}}
true
{{- else if not (has $mode (list "auto" "true" "false")) -}}
{{- fail (printf "rbac.leaderWorkerSet must be auto, true or false, not %q" $mode) -}}
{{- end -}}
{{- end }}
