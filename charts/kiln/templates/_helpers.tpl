{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "kiln.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's resources. */}}
{{- define "kiln.fullname" -}}
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

{{- define "kiln.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every resource of the chart carries. */}}
{{- define "kiln.labels" -}}
helm.sh/chart: {{ include "kiln.chart" . }}
{{ include "kiln.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kiln
{{- end }}

{{/* Labels the operator Deployment selects its pod by; never change them. */}}
{{- define "kiln.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kiln.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kiln.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kiln.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator's image: `image.repository` under `image.registry`, unless the repository
names a registry host of its own (a first path part with a dot or a port, as Docker reads it). */}}
{{- define "kiln.image" -}}
{{- $repo := .Values.image.repository }}
{{- $first := index (splitList "/" $repo) 0 }}
{{- if and .Values.image.registry (not (and (contains "/" $repo) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")))) }}
{{- $repo = printf "%s/%s" (trimSuffix "/" .Values.image.registry) $repo }}
{{- end }}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Registries RLJobs' images may come from: the allowlist, and Kiln's own registry. */}}
{{- define "kiln.imageRegistries" -}}
{{- $allowed := .Values.operator.allowed.imageRegistries }}
{{- if and .Values.image.registry (not (has "*" $allowed)) }}
{{- $allowed = append $allowed (printf "%s/" (trimSuffix "/" .Values.image.registry)) | uniq }}
{{- end }}
{{- toJson $allowed }}
{{- end }}

{{/* Namespaced permissions the operator needs to reconcile RLJobs (rules of a Role or ClusterRole). */}}
{{- define "kiln.namespacedRules" -}}
- apiGroups: ["kiln.dev"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["kiln.dev"]
  resources: ["rljobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: [""]
  # secrets: each job's CA and its components' certificates (mutual TLS between the services).
  resources: ["configmaps", "secrets"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  # delete: the finalizer removes PVCs whose spec says retain: false; an edited job that names
  # fewer frozen checkpoints (teachers, references, subagents, reward models) loses their
  # Services, Deployments and NetworkPolicies.
  resources: ["persistentvolumeclaims", "services"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{- /* The namespaces the operator watches, as a JSON list: the release's own in single-namespace
mode, else operator.watchNamespaces (empty: every namespace). */}}
{{- define "kiln.watchNamespaces" -}}
{{- if .Values.operator.singleNamespace -}}
{{- list .Release.Namespace | toJson -}}
{{- else -}}
{{- .Values.operator.watchNamespaces | default list | toJson -}}
{{- end -}}
{{- end }}

{{- /* The username the API server gives the operator's ServiceAccount. */}}
{{- define "kiln.operatorUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "kiln.serviceAccountName" . }}
{{- end }}
